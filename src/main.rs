//! The `gpushare` executable: parse the command line, run the role, map the outcome to an
//! exit status (0 ok, 1 failure, 64 usage, 78 configuration).

fn main() -> std::process::ExitCode {
    gpushare::cli::main_with_args(std::env::args_os().collect())
}
