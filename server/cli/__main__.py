"""`python -m quant_serve.server.cli`: the quant-serve command."""
import sys

from quant_serve.server.cli.main import main

sys.exit(main())
