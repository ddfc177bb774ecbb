from pathlib import Path

from draftline.core.runlog import logged
from draftline.stages.bundle import publish_files, push_to_hub, write_push_record

with logged(snakemake.log[0]):
    if snakemake.rule == "push_bundle_to_hub":
        pushed = push_to_hub(Path(snakemake.input.manifest).parent, snakemake.params.repo,
                             token_env=snakemake.params.token_env)
        write_push_record(snakemake.output[0], pushed)
    else:
        publish_files(snakemake.input.tar, snakemake.input.manifest, snakemake.output.tar,
                      snakemake.output.manifest, snakemake.output.sha256)
