rule generate:
    input:
        shard=LAYOUT.prompt_shard("{i}"),
        profile=profile_input(),
        target=target_input(),
    output:
        responses=LAYOUT.response_shard("{i}"),
        errors=LAYOUT.response_errors("{i}"),
        summary=LAYOUT.response_summary("{i}"),
    log:
        "logs/generate/shard-{i}.log",
    conda:
        "../envs/draftline.yaml"
    container:
        serving_container()
    params:
        generate=config["generate"],
        server=server_params(),
        model=target_path,
        revision=config["target"]["revision"],
        state_dir=SERVER_STATE,
        slot_dir=str(LAYOUT.generate_slots),
        code=code_hash("generate.py"),
    script:
        "../scripts/generate.py"


rule generation_summary:
    input:
        summaries=expand(rules.generate.output.summary, i=SHARDS),
        responses=expand(rules.generate.output.responses, i=SHARDS),
        target=target_input(),
    output:
        json=LAYOUT.generation_summary,
        png=report(
            LAYOUT.generation_plot,
            caption="../report/generation.rst",
            category="Generation",
        ),
    log:
        "logs/generation_summary/summary.log",
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
