// The launcher table (see launch_registry.h). A function-local static so that instantiation
// files may register from their static initialisers in any order.
#include "launch_registry.h"

namespace hstu {

Launcher* launcher_table() {
  static Launcher table[kLauncherSlots] = {};
  return table;
}

}  // namespace hstu
