from pathlib import Path

from draftline.core.runlog import logged
from draftline.stages.prompts import build_prompt_shards

with logged(snakemake.log[0]):
    build_prompt_shards(
        snakemake.params.sources,
        Path(snakemake.output.summary).parent,
        num_shards=snakemake.params.num_shards,
        max_samples=snakemake.params.max_samples,
        seed=snakemake.params.seed,
        max_line_bytes=snakemake.params.max_line_bytes,
    )
