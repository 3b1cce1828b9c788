"""In and out of a run: prompt files (``data``), metrics and loggers (``metrics``, ``plot``), evaluation and
sample grids (``evaluate``, ``media``), one run per folder (``run_lock``), weights out in diffusers' formats
(``export``, ``export_folder``) and ``sp-diffusers sample`` (``sample``)."""
