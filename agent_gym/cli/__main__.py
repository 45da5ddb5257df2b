from agent_gym.cli.main import main

raise SystemExit(main())
