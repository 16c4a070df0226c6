import sys

from hyper_adaptor.cli import main

sys.exit(main())
