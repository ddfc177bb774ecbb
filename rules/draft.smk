rule train_draft:
    input:
        unpack(train_states_input),
        vocab_map=rules.vocab_map.output.vocab_map,
        target=target_input(),
    output:
        best=directory(LAYOUT.draft_best),
        metrics=LAYOUT.train_metrics,
        eval=LAYOUT.train_eval,
    log:
        LAYOUT.log("train_draft", "train.log"),
    conda:
        "../envs/draftline.yaml"
    threads: workflow.cores
    params:
        train=main_train_params(),
        online=online_hidden_params(),
        server=online_server_params(),
        sampling=online_sampling_params(),
        state_dir=SERVER_STATE,
        model=target_path,
        revision=config["target"]["revision"],
        out_dir=lambda wildcards, output: os.path.dirname(output.eval),
        code=code_hash("train_draft.py"),
    script:
        "../scripts/train_draft.py"


rule export_draft:
    input:
        best=rules.train_draft.output.best,
        eval=rules.train_draft.output.eval,
        vocab_map=rules.vocab_map.output.vocab_map,
        target=target_input(),
    output:
        config=LAYOUT.checkpoint_config,
        weights=LAYOUT.checkpoint_weights,
    log:
        LAYOUT.log("export_draft", "export.log"),
    conda:
        "../envs/draftline.yaml"
    params:
        model=target_path,
        revision=config["target"]["revision"],
        code=code_hash("export_draft.py"),
    script:
        "../scripts/export_draft.py"


use rule train_draft as train_variant with:
    output:
        best=directory(LAYOUT.variant_best("{variant}")),
        metrics=LAYOUT.variant_metrics("{variant}"),
        eval=LAYOUT.variant_eval("{variant}"),
    log:
        LAYOUT.log("train_variant", "{variant}.log"),
    params:
        train=variant_train_params,


use rule export_draft as export_variant with:
    input:
        best=rules.train_variant.output.best,
        eval=rules.train_variant.output.eval,
        vocab_map=rules.vocab_map.output.vocab_map,
        target=target_input(),
    output:
        config=LAYOUT.variant_checkpoint_config("{variant}"),
        weights=LAYOUT.variant_checkpoint_weights("{variant}"),
    log:
        LAYOUT.log("export_variant", "{variant}.log"),
