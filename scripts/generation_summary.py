from draftline.core.runlog import logged
from draftline.stages.generation_report import build_generation_summary

with logged(snakemake.log[0]):
    build_generation_summary(
        snakemake.input.summaries,
        snakemake.output.json,
        snakemake.output.png,
        response_files=snakemake.input.responses,
        target_dir=snakemake.params.model,
        chat_template_kwargs=snakemake.params.chat_template_kwargs,
        trust_remote_code=snakemake.params.trust_remote_code,
        revision=snakemake.params.revision,
    )
