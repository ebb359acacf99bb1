import sys

from jaxsched.bench import main

sys.exit(main())
