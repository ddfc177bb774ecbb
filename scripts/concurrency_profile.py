from draftline.core.runlog import logged
from draftline.stages.profile import measure_concurrency_profile

with logged(snakemake.log[0]):
    measure_concurrency_profile(
        snakemake.input.shards,
        snakemake.output.json,
        snakemake.output.png,
        profile_cfg=snakemake.params.profile,
        sampling=snakemake.params.sampling,
        server_cfg=snakemake.params.server["server"],
        model=snakemake.params.model,
        state_dir=snakemake.params.state_dir,
        trust_remote_code=snakemake.params.server["trust_remote_code"],
        revision=snakemake.params.revision,
    )
