from megascale_data_ext.cli import main

raise SystemExit(main())
