from pathlib import Path

from draftline.core.hub import local_dir
from draftline.core.runlog import logged
from draftline.stages.train import train_draft

online = snakemake.params.online
with logged(snakemake.log[0]):
    train_draft(
        None if online else Path(snakemake.input.hidden).parent,
        snakemake.input.vocab_map,
        local_dir(snakemake.params.model, snakemake.params.revision),
        snakemake.params.out_dir,
        snakemake.params.train,
        online={"dataset_dir": snakemake.input.dataset, "hidden": online,
                "server": snakemake.params.server,
                "server_state_dir": snakemake.params.state_dir,
                "sampling": snakemake.params.sampling} if online else None,
    )
