import sys
from ipyfence.cli import main
main()
