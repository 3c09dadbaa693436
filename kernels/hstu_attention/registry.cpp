// The launcher table (see launch_registry.h). A function-local static so that instantiation
// files may register from their static initialisers in any order.
#include "launch_registry.h"

namespace hstu {

Launcher* launcher_table() {
  static Launcher table[2 * 2 * 2 * 4] = {};
  return table;
}

}  // namespace hstu
