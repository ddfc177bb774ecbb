from pathlib import Path

from draftline.core.hub import local_dir
from draftline.core.runlog import logged
from draftline.stages.vocab import build_vocab_map, target_vocab_size

with logged(snakemake.log[0]):
    build_vocab_map(
        snakemake.input.dataset,
        target_vocab_size(local_dir(snakemake.params.model, snakemake.params.revision)),
        snakemake.params.draft_vocab_size,
        Path(snakemake.output.vocab_map).parent,
        min_coverage=snakemake.params.min_coverage,
    )
