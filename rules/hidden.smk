rule hidden_states:
    input:
        dataset=res("dataset"),
        target=target_input(),
    output:
        index=res("hidden/index.json"),
    params:
        hidden=config["hidden"],
        server=server_params(),
        model=target_path,
        code=code_hash("hidden", "hidden_connector"),
    conda:
        "../envs/draftline.yaml"
    log:
        "logs/hidden_states/extract.log",
    threads: workflow.cores
    script:
        "../scripts/hidden_states.py"
