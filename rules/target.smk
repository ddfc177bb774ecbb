rule toy_target:
    output:
        directory(res("target")),
    params:
        toy=config["target"]["toy"],
        code=code_hash("toy"),
    conda:
        "../envs/draftline.yaml"
    log:
        "logs/toy_target/build.log",
    threads: 2
    resources:
        mem_mb=4000,
    script:
        "../scripts/toy_target.py"
