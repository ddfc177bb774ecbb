rule concurrency_profile:
    input:
        shards=rules.prompt_shards.output.shards,
        target=target_input(),
    output:
        json=LAYOUT.profile_json,
        png=report(
            LAYOUT.profile_png,
            caption="../report/concurrency.rst",
            category="Concurrency profile",
        ),
    log:
        LAYOUT.log("concurrency_profile", "profile.log"),
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
