from ipyfence.cli import main

main()
