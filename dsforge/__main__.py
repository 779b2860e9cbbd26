from dsforge.cli import main

main()
