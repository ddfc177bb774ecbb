rule bench:
    input:
        responses=expand(res("responses/shard-{i}.jsonl"), i=SHARDS),
        draft=res("draft/checkpoint/config.json"),
        weights=res("draft/checkpoint/model.safetensors"),
        eval=res("draft/eval.json"),
        profile=profile_input(),
        target=target_input(),
    output:
        results=res("bench/results.json"),
        summary=report(
            res("bench/summary.md"),
            caption="../report/bench_summary.rst",
            category="Deployment benchmark",
        ),
        throughput=report(
            res("bench/throughput.png"),
            caption="../report/bench_throughput.rst",
            category="Deployment benchmark",
        ),
        acceptance=report(
            res("bench/acceptance.png"),
            caption="../report/bench_acceptance.rst",
            category="Deployment benchmark",
        ),
    log:
        "logs/bench/bench.log",
    conda:
        "../envs/draftline.yaml"
    container:
        serving_container()
    params:
        bench=config["bench"],
        generate=config["generate"],
        eval_fraction=config["dataset"]["eval_fraction"],
        server=server_params(),
        revision=config["target"]["revision"],
        model=target_path,
        state_dir=SERVER_STATE,
        code=code_hash("bench.py"),
    script:
        "../scripts/bench.py"
