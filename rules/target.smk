rule toy_target:
    input:
        package_data("toy/sentences.txt"),
    output:
        target=directory(LAYOUT.target),
    log:
        "logs/toy_target/build.log",
    conda:
        "../envs/draftline.yaml"
    threads: 1
    resources:
        mem_mb=4000,
    params:
        toy=config["target"]["toy"],
        code=code_hash("toy_target.py"),
    script:
        "../scripts/toy_target.py"
