rule concurrency_profile:
    input:
        shards=expand(res("prompts/shard-{i}.jsonl"), i=SHARDS),
        target=target_input(),
    output:
        json=res("profile/concurrency.json"),
        png=report(
            res("profile/concurrency.png"),
            caption="../report/concurrency.rst",
            category="Concurrency profile",
        ),
    log:
        "logs/concurrency_profile/profile.log",
    conda:
        "../envs/draftline.yaml"
    container:
        serving_container()
    params:
        profile=config["profile"],
        sampling=sampling_params(),
        server=server_params(),
        revision=config["target"]["revision"],
        model=target_path,
        state_dir=SERVER_STATE,
        code=code_hash("concurrency_profile.py"),
    script:
        "../scripts/concurrency_profile.py"
