# One job answers every shard: one client, one budget of C requests in flight across all
# shard files, so the server stays full across shard boundaries (draftline.stages.generate).
rule generate:
    input:
        shards=rules.prompt_shards.output.shards,
        profile=profile_input(),
        target=target_input(),
    output:
        responses=expand(LAYOUT.response_shard("{i}"), i=SHARDS),
        errors=expand(LAYOUT.response_errors("{i}"), i=SHARDS),
        summaries=expand(LAYOUT.response_summary("{i}"), i=SHARDS),
    log:
        LAYOUT.log("generate", "generate.log"),
    conda:
        "../envs/draftline.yaml"
    container:
        serving_container()
    params:
        generate=config["generate"],
        eval_fraction=config["dataset"]["eval_fraction"],
        server=server_params(),
        model=target_path,
        revision=config["target"]["revision"],
        state_dir=SERVER_STATE,
        code=code_hash("generate.py"),
    script:
        "../scripts/generate.py"


rule generation_summary:
    input:
        summaries=rules.generate.output.summaries,
        responses=rules.generate.output.responses,
        target=target_input(),
    output:
        json=LAYOUT.generation_summary,
        png=report(
            LAYOUT.generation_plot,
            caption="../report/generation.rst",
            category="Generation",
        ),
    log:
        LAYOUT.log("generation_summary", "summary.log"),
    conda:
        "../envs/draftline.yaml"
    params:
        model=target_path,
        chat_template_kwargs=config["generate"]["chat_template_kwargs"],
        trust_remote_code=config["target"]["trust_remote_code"],
        revision=config["target"]["revision"],
        code=code_hash("generation_summary.py"),
    script:
        "../scripts/generation_summary.py"
