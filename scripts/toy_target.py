from draftline.core.runlog import logged
from draftline.stages.toy import build_toy_target

with logged(snakemake.log[0]):
    build_toy_target(snakemake.output[0], snakemake.params.toy)
