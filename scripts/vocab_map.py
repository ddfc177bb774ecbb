from pathlib import Path

from draftline.hub import local_dir
from draftline.runlog import logged
from draftline.vocab import target_vocab_size, write_vocab

with logged(snakemake.log[0]):
    write_vocab(
        snakemake.input.dataset,
        target_vocab_size(local_dir(snakemake.params.model, snakemake.params.revision)),
        snakemake.params.draft_vocab_size,
        Path(snakemake.output.vocab_map).parent,
    )
