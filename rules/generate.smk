rule generate:
    input:
        shard=res("prompts/shard-{i}.jsonl"),
        profile=profile_input(),
        target=target_input(),
    output:
        responses=res("responses/shard-{i}.jsonl"),
        errors=res("responses/shard-{i}.errors.jsonl"),
        summary=res("responses/shard-{i}.summary.json"),
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
        slot_dir=res(".slots/generate"),
        code=code_hash("generate.py"),
    script:
        "../scripts/generate.py"


rule generation_summary:
    input:
        summaries=expand(res("responses/shard-{i}.summary.json"), i=SHARDS),
        responses=expand(res("responses/shard-{i}.jsonl"), i=SHARDS),
        target=target_input(),
    output:
        json=res("responses/summary.json"),
        png=report(
            res("responses/server_running.png"),
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
