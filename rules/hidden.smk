rule hidden_states:
    input:
        dataset=rules.dataset.output.dataset,
        target=target_input(),
    output:
        index=LAYOUT.hidden_index,
    log:
        LAYOUT.log("hidden_states", "extract.log"),
    conda:
        "../envs/draftline.yaml"
    container:
        serving_container()
    threads: workflow.cores
    params:
        hidden=offline_hidden_params(),
        server=hidden_engine_params(),
        sampling=answer_sampling(),
        model=target_path,
        revision=config["target"]["revision"],
        state_dir=SERVER_STATE,
        code=code_hash("hidden_states.py"),
    script:
        "../scripts/hidden_states.py"
