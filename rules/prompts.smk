rule prompt_shards:
    input:
        prompt_source_files(),
    output:
        shards=LAYOUT.prompt_shards(len(SHARDS)),
        rejected=LAYOUT.prompts_rejected,
        summary=LAYOUT.prompts_summary,
    log:
        LAYOUT.log("prompt_shards", "build.log"),
    conda:
        "../envs/draftline.yaml"
    params:
        sources=config["prompts"]["sources"],
        max_samples=config["prompts"]["max_samples"],
        num_shards=config["prompts"]["num_shards"],
        seed=config["prompts"]["seed"],
        max_line_bytes=config["prompts"]["max_line_bytes"],
        code=code_hash("prompt_shards.py"),
    script:
        "../scripts/prompt_shards.py"
