rule toy_target:
    output:
        directory(res("target")),
    log:
        "logs/toy_target/build.log",
    conda:
        "../envs/draftline.yaml"
    threads: 2
    resources:
        mem_mb=4000,
    params:
        toy=config["target"]["toy"],
        code=code_hash("toy"),
    script:
        "../scripts/toy_target.py"
