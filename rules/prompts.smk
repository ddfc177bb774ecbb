rule prompt_shards:
    input:
        prompt_source_files(),
    output:
        shards=expand(res("prompts/shard-{i}.jsonl"), i=SHARDS),
        rejected=res("prompts/rejected.jsonl"),
        summary=res("prompts/summary.json"),
    log:
        "logs/prompt_shards/build.log",
    conda:
        "../envs/draftline.yaml"
    params:
        sources=config["prompts"]["sources"],
        max_samples=config["prompts"]["max_samples"],
        num_shards=config["prompts"]["num_shards"],
        seed=config["prompts"]["seed"],
        code=code_hash("prompt_shards.py"),
    script:
        "../scripts/prompt_shards.py"
