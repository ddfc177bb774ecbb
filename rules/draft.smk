rule train_draft:
    input:
        hidden=res("hidden/index.json"),
        vocab_map=res("vocab/vocab_map.safetensors"),
        target=target_input(),
    output:
        best=directory(res("draft/best")),
        metrics=res("draft/metrics.jsonl"),
        eval=res("draft/eval.json"),
    log:
        "logs/train_draft/train.log",
    conda:
        "../envs/draftline.yaml"
    threads: workflow.cores
    params:
        train=config["train"],
        model=target_path,
        revision=config["target"]["revision"],
        out_dir=lambda wildcards, output: os.path.dirname(output.eval),
        code=code_hash("train_draft.py"),
    script:
        "../scripts/train_draft.py"


rule export_draft:
    input:
        best=res("draft/best"),
        hidden=res("hidden/index.json"),
        vocab_map=res("vocab/vocab_map.safetensors"),
        target=target_input(),
    output:
        config=res("draft/checkpoint/config.json"),
        weights=res("draft/checkpoint/model.safetensors"),
    log:
        "logs/export_draft/export.log",
    conda:
        "../envs/draftline.yaml"
    params:
        model=target_path,
        revision=config["target"]["revision"],
        code=code_hash("export_draft.py"),
    script:
        "../scripts/export_draft.py"
