import sys

from engram_trt.cli.main import main

sys.exit(main())
