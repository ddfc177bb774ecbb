from pathlib import Path

from draftline.core.runlog import logged
from draftline.stages.bundle import BundleInputs, build_bundle

with logged(snakemake.log[0]):
    inp = snakemake.input
    profile = {Path(p).suffix: p for p in inp.profile}
    build_bundle(
        BundleInputs(
            checkpoint_dir=Path(inp.checkpoint).parent,
            vocab_map=inp.vocab_map,
            coverage=inp.coverage,
            metrics=inp.metrics,
            eval=inp.eval,
            prompts_summary=inp.prompts_summary,
            generation_summary=inp.generation,
            profile_json=profile.get(".json"),
            profile_png=profile.get(".png"),
            bench_files=list(inp.bench),
            variant_dirs={
                name: Path(eval_json).parent
                for name, eval_json in zip(
                    snakemake.params.variants, inp.variant_evals, strict=True
                )
            },
        ),
        Path(snakemake.output.manifest).parent,
        snakemake.output.tar,
        config=snakemake.params.config,
        model=snakemake.params.model,
        draft_ref=snakemake.params.draft_ref,
        card_html=snakemake.output.card,
        build_record=snakemake.output.record,
    )
