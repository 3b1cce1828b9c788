"""The model families: how the trainer calls each transformer (``adapters``; FLUX.1: ``flux``), how latents reach
a VAE (``decode``), Wan2.2's two experts (``experts``), a diffusers pipeline folder in (``pipeline_io``) and what a
run needs of it (``folder_checks``), and the text encoders (``text``)."""
