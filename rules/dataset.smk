rule dataset:
    input:
        responses=rules.generate.output.responses,
        target=target_input(),
    output:
        dataset=directory(LAYOUT.dataset),
    log:
        LAYOUT.log("dataset", "build.log"),
    conda:
        "../envs/draftline.yaml"
    params:
        model=target_path,
        eval_fraction=config["dataset"]["eval_fraction"],
        max_length=config["dataset"]["max_length"],
        trust_remote_code=config["target"]["trust_remote_code"],
        revision=config["target"]["revision"],
        chat_template_kwargs=config["generate"]["chat_template_kwargs"],
        code=code_hash("dataset.py"),
    script:
        "../scripts/dataset.py"


rule vocab_map:
    input:
        dataset=rules.dataset.output.dataset,
        target=target_input(),
    output:
        vocab_map=LAYOUT.vocab_map,
        coverage=LAYOUT.vocab_coverage,
    log:
        LAYOUT.log("vocab_map", "build.log"),
    conda:
        "../envs/draftline.yaml"
    params:
        model=target_path,
        revision=config["target"]["revision"],
        draft_vocab_size=config["vocab"]["draft_vocab_size"],
        min_coverage=config["vocab"]["min_coverage"],
        code=code_hash("vocab_map.py"),
    script:
        "../scripts/vocab_map.py"
