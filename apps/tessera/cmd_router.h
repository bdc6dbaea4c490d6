// tessera router train (cmd_router.cpp). Its own header rather than commands.h, so adding the
// command did not rebuild every other command.
#pragma once

namespace CLI { class App; }

namespace tessera::cli {
void add_router_command(CLI::App& app);
}  // namespace tessera::cli
