// A generation sampled non-finite logits (from non-finite weights or config values); the message names the stream
// and position. Its own header: the rank workers rethrow it with its kind kept, without the target model.
#pragma once
#include <stdexcept>

namespace ddtree {

class NonFiniteLogits : public std::domain_error {
  public:
    using std::domain_error::domain_error;
};

}  // namespace ddtree
