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
    params:
        profile=config["profile"],
        sampling=sampling_params(),
        server=server_params(),
        model=target_path,
        state_dir=SERVER_STATE,
        code=code_hash("profile", "loadgen", "server"),
    conda:
        "../envs/draftline.yaml"
    log:
        "logs/concurrency_profile/profile.log",
    script:
        "../scripts/concurrency_profile.py"
