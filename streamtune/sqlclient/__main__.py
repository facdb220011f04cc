"""`python -m streamtune.sqlclient ARGS` runs `streamtune sql ARGS`."""

import sys

from streamtune.sqlclient.command import main

sys.exit(main())
