"""`streamtune sql`: Flink SQL files and a prompt over a PyFlink TableEnvironment.

| module     | holds                                                                  |
|------------|------------------------------------------------------------------------|
| scanner    | the one reading of SQL text: quotes, comments, statement ends           |
| runner     | the TableEnvironment, ${variables}, running statements and files        |
| prompt     | the interactive prompt                                                  |
| command    | the `sql` subcommand (argparse) and its exit codes                      |
| errors     | SqlError, a core.errors.StreamtuneError                                 |

From Python: `from streamtune.sqlclient.runner import new_table_env, run_file`.
"""
