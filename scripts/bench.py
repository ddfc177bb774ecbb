import os

from draftline.core.runlog import logged
from draftline.stages.bench import measure_deployment_benchmark

with logged(snakemake.log[0]):
    measure_deployment_benchmark(
        snakemake.input.responses,
        os.path.dirname(snakemake.input.draft),
        snakemake.input.eval,
        snakemake.input.profile or None,
        os.path.dirname(snakemake.output.results),
        bench_cfg=snakemake.params.bench,
        generate_cfg=snakemake.params.generate,
        eval_fraction=snakemake.params.eval_fraction,
        server_cfg=snakemake.params.server["server"],
        model=snakemake.params.model,
        state_dir=snakemake.params.state_dir,
        trust_remote_code=snakemake.params.server["trust_remote_code"],
        revision=snakemake.params.revision,
        variant_dirs={
            name: os.path.dirname(eval_json)
            for name, eval_json in zip(
                snakemake.params.variants, snakemake.input.variant_evals, strict=True
            )
        },
    )
