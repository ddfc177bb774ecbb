import json
from pathlib import Path

from draftline.core.hub import local_dir
from draftline.core.runlog import logged
from draftline.stages.export import export_draft

with logged(snakemake.log[0]):
    # the layers training read (from the stored index or produced online)
    layer_ids = json.loads(Path(snakemake.input.eval).read_text())["layer_ids"]
    export_draft(
        snakemake.input.best,
        local_dir(snakemake.params.model, snakemake.params.revision),
        snakemake.input.vocab_map,
        layer_ids,
        Path(snakemake.output.config).parent,
    )
