from draftline.core.runlog import logged
from draftline.stages.smollm2 import build_smollm2_target

with logged(snakemake.log[0]):
    build_smollm2_target(snakemake.output[0])
