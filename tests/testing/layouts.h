// Parameter layouts shared by the tests of the partition's users (the swapper's, the engine's
// memory plan), so that their cases cut the same model.
#pragma once

#include <utility>

#include "zinf/core/check.h"
#include "zinf/partition/layout.h"

namespace zinf::testing {

// Six parameters of uneven sizes (matrices, an odd vector, a scalar): sub-group, fragment and
// alignment boundaries fall inside parameters.
inline partition::ParamLayout UnevenLayout() {
  auto layout = partition::ParamLayout::Create({{"embed", {37, 129}},
                                                {"w1", {2048, 3}},
                                                {"b1", {17}},
                                                {"w2", {1500, 7}},
                                                {"scale", {}},
                                                {"head", {4099}}});
  ZINF_CHECK(layout.has_value());
  return std::move(*layout);
}

}  // namespace zinf::testing
