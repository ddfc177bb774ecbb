from draftline.runlog import logged
from draftline.toy import build_toy_target

with logged(snakemake.log[0]):
    build_toy_target(snakemake.output[0], snakemake.params.toy)
