from draftline.core.runlog import logged
from draftline.stages.dataset import build_dataset

with logged(snakemake.log[0]):
    build_dataset(
        snakemake.input.responses,
        snakemake.params.model,
        snakemake.output[0],
        eval_fraction=snakemake.params.eval_fraction,
        max_length=snakemake.params.max_length,
        trust_remote_code=snakemake.params.trust_remote_code,
        chat_template_kwargs=snakemake.params.chat_template_kwargs,
        revision=snakemake.params.revision,
    )
