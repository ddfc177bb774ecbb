from draftline.core.runlog import logged
from draftline.stages.generate import generate_responses

with logged(snakemake.log[0]):
    generate_responses(
        snakemake.input.shards,
        snakemake.output.responses,
        snakemake.output.errors,
        snakemake.output.summaries,
        gen_cfg=snakemake.params.generate,
        server_cfg=snakemake.params.server["server"],
        model=snakemake.params.model,
        state_dir=snakemake.params.state_dir,
        profile_json=snakemake.input.profile or None,
        trust_remote_code=snakemake.params.server["trust_remote_code"],
        revision=snakemake.params.revision,
        eval_fraction=snakemake.params.eval_fraction,
    )
