#include "tessera/gateway/deployment.h"

namespace tessera {
namespace {

class EngineHandle : public RequestHandle {
 public:
  EngineHandle(Engine& engine, uint64_t id) : engine_(engine), id_(id) {}
  // Engine::cancel ignores ids it no longer knows, so a late or repeated cancel is harmless.
  void cancel(CancelReason) override { engine_.cancel(id_); }

 private:
  Engine& engine_;
  uint64_t id_;
};

}  // namespace

Status EngineDeployment::submit(DeploymentRequest request, std::shared_ptr<RequestSink> sink,
                                std::unique_ptr<RequestHandle>* handle) {
  GenerationRequest& g = request.generation;
  if (Status st = engine_.check(g); !st.is_ok()) return st;
  ServedBy served;
  served.deployment = name_;
  sink->on_start(served);
  g.on_event = [sink](const GenerationEvent& ev) { sink->on_event(ev); };
  uint64_t id = 0;
  if (Status st = engine_.submit(std::move(g), &id); !st.is_ok()) return st;
  *handle = std::make_unique<EngineHandle>(engine_, id);
  return Status::ok();
}

}  // namespace tessera
