from pathlib import Path

from draftline.runlog import logged
from draftline.train import train

with logged(snakemake.log[0]):
    train(
        Path(snakemake.input.hidden).parent,
        snakemake.input.vocab_map,
        snakemake.params.model,
        snakemake.params.out_dir,
        snakemake.params.train,
    )
