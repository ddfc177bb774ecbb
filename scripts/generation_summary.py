from draftline.generation_report import run_stage
from draftline.runlog import logged

with logged(snakemake.log[0]):
    run_stage(snakemake.input.summaries, snakemake.output.json, snakemake.output.png)
