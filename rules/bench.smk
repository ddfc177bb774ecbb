rule bench:
    input:
        responses=rules.generate.output.responses,
        draft=rules.export_draft.output.config,
        weights=rules.export_draft.output.weights,
        eval=rules.train_draft.output.eval,
        profile=profile_input(),
        target=target_input(),
        further_drafts=compare_draft_files(),
        variant_configs=variant_files(LAYOUT.variant_checkpoint_config),
        variant_weights=variant_files(LAYOUT.variant_checkpoint_weights),
        variant_evals=variant_files(LAYOUT.variant_eval),
    output:
        results=LAYOUT.bench_results,
        summary=report(
            LAYOUT.bench_summary,
            caption="../report/bench_summary.rst",
            category="Deployment benchmark",
        ),
        throughput=report(
            LAYOUT.bench_plots[0],
            caption="../report/bench_throughput.rst",
            category="Deployment benchmark",
        ),
        acceptance=report(
            LAYOUT.bench_plots[1],
            caption="../report/bench_acceptance.rst",
            category="Deployment benchmark",
        ),
    log:
        LAYOUT.log("bench", "bench.log"),
    conda:
        "../envs/draftline.yaml"
    container:
        serving_container()
    params:
        bench=config["bench"],
        variants=VARIANTS,
        generate=bench_generate_params(),
        eval_fraction=config["dataset"]["eval_fraction"],
        server=server_params(),
        revision=config["target"]["revision"],
        model=target_path,
        state_dir=SERVER_STATE,
        code=code_hash("bench.py"),
    script:
        "../scripts/bench.py"
