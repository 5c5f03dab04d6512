from supervisor.cli import main

main()
