from pathlib import Path

from draftline.core.hub import local_dir
from draftline.core.runlog import logged
from draftline.stages.hidden import extract_hidden_states

with logged(snakemake.log[0]):
    extract_hidden_states(
        snakemake.input.dataset,
        local_dir(snakemake.params.model, snakemake.params.revision),
        Path(snakemake.output.index).parent,
        snakemake.params.hidden,
        server_cfg=snakemake.params.server,
        server_state_dir=snakemake.params.state_dir,
        sampling=snakemake.params.sampling,
    )
