"""The ``engram-trt`` command line (:func:`engram_trt.cli.main.main`)."""
